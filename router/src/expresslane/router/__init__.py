"""expresslane router: the OpenAI-compatible front door for both lanes."""
