"""Integer size arithmetic shared by every layer, from the kernels up to the router; it imports
nothing, so the router can use it without loading torch."""


def ceil_div(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded up: the pages ``numerator`` tokens fill, the tiles
    ``numerator`` rows take."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``): a kernel's block for ``n``
    elements. Plain Python: ``triton.next_power_of_2`` is a constexpr function, which costs
    ~13 us a call on the host, several calls in every layer of an eager forward."""
    return 1 << max(0, n - 1).bit_length()
