"""Layer 6: the HTTP server. http.py builds the FastAPI app over an `EngineClient`;
openai_routes.py and native_routes.py are the routes, protocol.py / responses.py the
OpenAI request and response bodies, validate.py and errors.py the 4xx paths."""
