"""The web page `tokenmill serve` (and `tokenmill router`) answers at `/`: a chat playground and a live
dashboard. `index.html`, `app.js` and `style.css` are served as they are (no build step, no CDN:
`tokenmill.http_front.add_ui_page`); `stats.py` computes the dashboard's numbers for `/ui/stats`."""
