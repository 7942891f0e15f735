"""Config-free building blocks of the decoder-only transformer and the models made of them."""
