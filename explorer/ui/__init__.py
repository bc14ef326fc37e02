"""The Streamlit UI, one module per page or panel. It reads traces (plain data) and never touches model tensors;
``app.py`` at the project root routes between the pages."""
