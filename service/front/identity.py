"""What the service calls itself in metadata answers (KServe v2 server metadata, OpenAI model owner, the
OpenAPI page), on every protocol."""

SERVER_NAME = "mha-encoder-serving"
SERVER_VERSION = "0.1.0"
