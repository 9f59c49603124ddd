"""The Trainer actor: steps an inner loop on each batch and publishes the weights it makes."""
