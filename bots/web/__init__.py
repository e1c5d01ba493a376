"""``rlfleet web``: the browser as a front end, for the data dir's owner (docs/web.md).

Like every front end it only translates: the page's requests become the ingress use cases' events (source
``web``, the local actor), answered by the local responder; nothing here decides what a rating does.
"""
