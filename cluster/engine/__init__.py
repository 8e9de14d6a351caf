"""The engine with no Ray in it: the step (one function every deployment runs), its executors, the in-process engine, the public engine interface, and the replica audit."""
