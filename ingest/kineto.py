from .records import ParseError


def parse_kineto(stream, name, hint, limits):
    raise ParseError("Kineto ingester not implemented yet")
