// Server-sent events over fetch + ReadableStream, so requests can carry an Authorization
// header and be cancelled with an AbortController (EventSource can do neither).

// Calls onEvent({event, data}) for each event of `response`'s body; resolves at the end of the
// stream, rejects with an AbortError when the request's signal is aborted.
export async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { event: "message", data: "" };
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue; // a comment (keep-alive ping)
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "data") data.push(val);
        else if (field === "event") event.event = val;
      }
      if (data.length) {
        event.data = data.join("\n");
        onEvent(event);
      }
    }
  }
}

export function authHeaders(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// The OpenAI-shaped error message of a failed response, or its status line.
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) {
    /* not JSON */
  }
  return `${response.status} ${response.statusText}`;
}
