"""The gateway's roof: the app that assembles every route module, the server and its connection
guard, the OpenAPI document and the service endpoints. Nothing in the gateway imports it."""
