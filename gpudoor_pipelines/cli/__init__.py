"""``gpudoor``: the command-line front ends (``main``), for people and coding agents."""
