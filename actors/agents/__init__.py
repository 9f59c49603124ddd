"""Agents: agent code written for the OpenAI API, trained as it is, each episode a guest of the generator.

    task.py           ``task: {agent: ...}``: the agent, its problems, its episodes' settings; its runner
    host.py           the agent host: a supervisor that forks each episode's agent as a guest
    wire.py           what travels between a generator and its agent host
    guests.py         who an episode runs as, and what of the machine it sees
    endpoint.py       the run's OpenAI-compatible endpoint, one episode per key
    openai_fields.py  what the endpoint does with each field of OpenAI's requests
    chat_tokens.py    the stitcher: an episode as the tokens sampled, whatever its messages re-tokenize to
    examples/         agents with a python tool, as the CPU topologies train them
"""
