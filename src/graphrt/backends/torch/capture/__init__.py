"""Building graphs: the builder, piecewise and breakable capture, the FX split, baked-value checks, graph memory, the capture linter, callable graphs."""
