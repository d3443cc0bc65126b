"""What both sides share: spaces, episode chunks and running statistics (numpy only)."""
