"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""


class QerlError(Exception):
    """A problem with the user's input (config, model path, dataset, adapter) that they can fix."""


def read_utf8(path) -> str:
    """The file's text; a QerlError naming the first line that is not UTF-8."""
    data = open(path, "rb").read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise QerlError(f"{path}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x})") from None
