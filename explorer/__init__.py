"""Speculative decoding explorer: a step-wise engine (AR, SD, MCSD, improved MCSD) whose every step is a plain-data
trace, plus figures and a Streamlit app that draw those traces."""
