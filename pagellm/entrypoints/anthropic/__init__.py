"""Anthropic's Messages API (`/v1/messages`), an adapter onto the chat endpoint's engine path."""
