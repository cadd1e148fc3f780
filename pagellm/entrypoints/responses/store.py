"""The stored responses (`store: true`, the Responses API's default): what `GET /v1/responses/{id}`
returns and what `previous_response_id` continues. In memory and bounded: the least recently
used response goes when MAX_STORED_RESPONSES are held, and a server restart forgets them all."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Enough for an agent loop's recent turns; each holds its conversation's text, not its KV.
MAX_STORED_RESPONSES = 1024


@dataclass
class StoredResponse:
    response: dict       # the response object, as returned
    items: list[dict]    # the conversation so far, as input items: earlier turns, this input, this output


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, items: list[dict]) -> None:
        self._entries[response["id"]] = StoredResponse(response, items)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
