"""The error every layer raises for bad input (exit 2 at the CLI), below the modules that raise it."""


class ScenarioError(ValueError):
    """Bad scenario input; the message names the field and the problem."""
