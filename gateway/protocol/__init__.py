"""OpenAI wire models (pydantic): one module per endpoint plus the shared base."""
