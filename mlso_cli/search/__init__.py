"""Search: abstract expressions, enumeration, the cost model and the result cache."""
