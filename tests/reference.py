"""The tests' references are the package's (torch_hca.reference): seeded inputs and float64
references computed with torch alone, never through hca."""
from torch_hca.reference import (  # noqa: F401
    BITWISE, DTYPES, FLOATS, MOVED_ONLY, OPS, all_gather_single, make_input, mismatch, rank_device,
    reduce_reference, reduce_scatter_single, supported, tolerance, wrong_elements)
