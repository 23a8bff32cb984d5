"""expresslane engine: express-lane KV connector (vLLM V1), decode server, decode engines."""
