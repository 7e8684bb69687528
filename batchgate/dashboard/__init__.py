"""`batchgate dashboard`: a web page of every queue, live (FastAPI, server-sent events).
The page and its script ship in static/; nothing is loaded from elsewhere."""
