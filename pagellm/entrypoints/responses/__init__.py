"""OpenAI's Responses API (`/v1/responses`), an adapter onto the chat endpoint's engine path."""
