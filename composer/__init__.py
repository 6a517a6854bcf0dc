"""The algorithm composer: declare an LLM post-training method as a YAML graph of components."""

__version__ = "0.1.0"
