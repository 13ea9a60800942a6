"""The layout of a launch and the processes that run it: world, engine, accelerator, supervision."""
