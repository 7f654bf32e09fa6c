"""The composed Hydra config -> one typed recipe: a module per section (schema, checks,
resolution), the typed configs of every command, and the recipe made of the sections."""
