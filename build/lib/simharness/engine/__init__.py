"""The real decode loop: target model, decode loop, and the backends the SimPy model drives."""
