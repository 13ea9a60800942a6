"""What a run is asked to do: the recipe (YAML -> typed config) and the arithmetic read from it alone."""
