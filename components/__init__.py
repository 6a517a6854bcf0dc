"""The built-in component library. Importing it registers every built-in kind."""

from components import environments, guides, objectives, signals, sources, tasks  # noqa: F401
