"""Lightning callbacks for studying depth routing."""
