"""Validation of every op's arguments into frozen problems: shapes, dtypes, strides and host values only,
no device work, so every mistake is a ValueError/TypeError naming the argument, testable without a GPU."""
