"""The pipelines_port conformance suite: vectors, a mock platform, and checks for any port."""
