class ConfigError(ValueError):
    """A bad configuration value. The message names the key (dotted path) and what to change."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config error at '{key}': {message}")
