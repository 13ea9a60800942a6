"""The model a recipe asks for: built, initialised, its loss and its optimizer."""
