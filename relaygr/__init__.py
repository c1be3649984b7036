"""RelayGR: relay-race serving of long-sequence generative recommendation on Kafka."""

__version__ = "0.1.0"
