"""Integer size arithmetic shared by every layer, from the kernels up to the router; it imports
nothing, so the router can use it without loading torch."""


def ceil_div(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded up: the pages ``numerator`` tokens fill, the tiles
    ``numerator`` rows take."""
    return -(-numerator // denominator)
