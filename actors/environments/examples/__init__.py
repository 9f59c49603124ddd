"""Small environments the tests and the CPU topologies play: an OpenEnv server and a verifiers taskset."""
