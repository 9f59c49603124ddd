"""The Rewarder actor and the reward functions it runs on each completion."""
