"""A step's tokens back to requests: acceptance, stop strings on bytes, finish rules, detokenizing and outputs."""
