"""User-facing errors: the CLI prints the message as one line and exits with status 2."""


class UserError(Exception):
    """A mistake in the user's command, config, mesh or rule set; the message says how to fix it."""
