"""The real decode loop: the target model, the decode step and its CUDA graphs, and the torch backend the engine
loop drives at the measured levels."""
