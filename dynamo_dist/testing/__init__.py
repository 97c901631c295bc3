"""Tools that exercise the product from the outside, as a user would: the model zoo (``zoo``),
the OpInfo conformance sweep (``conformance``), the demo (``demo``) and its Llama (``models``),
and torchtitan helpers (``torchtitan``). Nothing in the product imports this package."""
