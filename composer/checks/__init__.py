"""The checks of a loaded spec: the component graph, the method rules, the layered validation, the terms."""
