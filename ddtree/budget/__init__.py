"""How many draft nodes a round gets: policies (``policy``) and the verify-latency models they use (``latency``)."""
