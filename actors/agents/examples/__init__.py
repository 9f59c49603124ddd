"""Small agents the tests and the CPU topologies train: agents with a ``python`` tool."""
