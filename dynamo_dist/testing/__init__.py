"""Tools that exercise the product from the outside, as a user would: the model zoo (``zoo``).
Nothing in the product imports this package."""
