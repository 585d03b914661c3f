"""Stop strings over a growing completion text, with vLLM's semantics: the text ends just before the
earliest stop string (or just after it with include_stop_str_in_output), a match may span the
pieces it arrived in, and a streaming client is sent nothing that could still turn out to be the
start of a stop string (the last longest-stop - 1 characters are held back until they cannot match).
Only generated text is searched, never the prompt."""


class StopStrings:
    def __init__(self, stops: list[str], include_in_output: bool = False):
        self.stops = [s for s in stops if s]
        self.include_in_output = include_in_output
        self.longest = max((len(s) for s in self.stops), default=0)
        self.hold_chars = self.longest - 1 if self.stops and not include_in_output else 0
        self.text = ""             # every generated character so far (up to the stop, once stopped)
        self.sent = 0              # characters handed out by add()
        self.stopped = False

    def add(self, piece: str) -> tuple[str, bool]:
        """(text that may be sent now, whether a stop string ended the completion)."""
        if self.stopped:
            return "", True
        search_from = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        hit = None
        for stop in self.stops:
            at = self.text.find(stop, search_from)
            if at != -1 and (hit is None or at < hit[0]):
                hit = (at, stop)
        if hit is not None:
            self.stopped = True
            self.text = self.text[:hit[0] + (len(hit[1]) if self.include_in_output else 0)]
            return self._take(len(self.text)), True
        return self._take(len(self.text) - self.hold_chars), False

    def flush(self) -> str:
        """What is held back, once the completion has ended without a stop string."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out
