"""The error every layer raises for bad input (exit 2 at the CLI), and the note for surprising but valid input,
below the modules that raise them."""


class ScenarioError(ValueError):
    """Bad scenario input; the message names the field and the problem."""


class ScenarioNote(UserWarning):
    """A scenario input that is valid but does something the user may not expect (the CLI prints it)."""
