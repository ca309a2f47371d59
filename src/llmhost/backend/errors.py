"""Errors a client caused; their message is sent back as the error response."""


class RequestError(ValueError):
    """The client sent something we cannot serve; the message names what."""
