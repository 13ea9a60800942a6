"""Answers before any process exists: the memory estimate, the layout planner, the MBS sweep."""
