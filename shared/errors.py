"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""


class QerlError(Exception):
    """A problem with the user's input (config, model path, dataset, adapter) that they can fix."""
