"""Thin typer wrappers: parse options -> typed config -> call the library -> print a summary."""
