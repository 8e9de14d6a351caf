"""A runner that stands in for a model with a modelled GPU step time (``model.simulate``, scale-out benches)."""
